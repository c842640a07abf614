/* Stand-in for crazyflie-firmware's stabilizer_types.h, reduced to what controller_oot.c uses.
 * The stubs in this directory let `make adapter-check` compile the adapter here, where no firmware
 * checkout exists: they pin the names, types and units of the firmware API (master, 2024-2025)
 * the adapter relies on. They prove nothing about the real headers; the real build does. */
#ifndef STABILIZER_TYPES_H
#define STABILIZER_TYPES_H
#include <stdbool.h>
#include <stdint.h>

typedef struct { float x; float y; float z; } Axis3f;
typedef struct { uint32_t timestamp; float roll; float pitch; float yaw; } attitude_t;
struct vec3_s { uint32_t timestamp; float x; float y; float z; };
typedef struct vec3_s point_t;
typedef struct vec3_s velocity_t;
typedef struct vec3_s acc_t;
typedef struct {
  uint32_t timestamp;
  union {
    struct { float q0; float q1; float q2; float q3; };
    struct { float x; float y; float z; float w; };
  };
} quaternion_t;
typedef struct { float pressure; float temperature; float asl; } baro_t;
typedef struct {
  Axis3f acc;  /* Gs */
  Axis3f gyro; /* deg/s */
  Axis3f mag;
  baro_t baro;
  uint64_t interruptTimestamp;
} sensorData_t;
typedef struct {
  attitude_t attitude;
  quaternion_t attitudeQuaternion;
  point_t position;    /* m */
  velocity_t velocity; /* m/s */
  acc_t acc;
} state_t;

#define STABILIZER_NR_OF_MOTORS 4
typedef enum { controlModeLegacy = 0, controlModeForceTorque = 1, controlModeForce = 2 } control_mode_t;
typedef struct {
  union {
    struct { int16_t roll; int16_t pitch; int16_t yaw; float thrust; };
    struct { float thrustSi; union { float torque[3]; struct { float torqueX; float torqueY; float torqueZ; }; }; };
    float normalizedForces[STABILIZER_NR_OF_MOTORS]; /* 0..1 of THRUST_MAX per motor */
  };
  control_mode_t controlMode;
} control_t;

typedef enum { modeDisable = 0, modeAbs, modeVelocity } stab_mode_t;
typedef struct {
  uint32_t timestamp; /* FreeRTOS ticks when the commander received it */
  attitude_t attitude;
  attitude_t attitudeRate;
  quaternion_t attitudeQuaternion;
  float thrust;
  point_t position;    /* m */
  velocity_t velocity; /* m/s */
  acc_t acceleration;
  bool velocity_body;
  struct { stab_mode_t x, y, z, roll, pitch, yaw, quat; } mode;
} setpoint_t;

typedef uint32_t stabilizerStep_t;
#define RATE_100_HZ 100
#define RATE_MAIN_LOOP 1000
#define RATE_DO_EXECUTE(RATE_HZ, TICK) ((TICK % (RATE_MAIN_LOOP / RATE_HZ)) == 0)
#endif
