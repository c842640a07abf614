/* Firmware-independent half of the Crazyflie policy controller (C99, no heap, no firmware headers).
 *
 * controller_oot.c copies the firmware's state estimate, gyro and setpoint into a cfp_input_t
 * (SI units except the gyro, which stays in the firmware's deg/s) and calls cfp_update() on every
 * stabilizer step. The glue decides who drives the motors:
 *
 *   CFP_IDLE      motors off (normalized force 0)
 *   CFP_POLICY    the exported network, evaluated once per policy period (10 ms), action held in between
 *   CFP_FALLBACK  the stock PID controller (the adapter calls it with the firmware's setpoint)
 *
 * Rules, checked in this order on every call:
 *   1. Stop setpoint (no position control and zero thrust, e.g. cflib send_stop_setpoint): IDLE.
 *      A fresh one also clears a latched fault: a stop sent to the commander (the operator's, or the
 *      high-level commander's at its stop or at the end of a landing) is the only way to re-arm
 *      the policy after a fault. The supervisor's own stop (its null setpoint, stamped 0, which it
 *      substitutes in every state that does not allow flight) leaves the fault latched.
 *   2. The policy was flying and the setpoint got older than deadman_ms (link lost), or the policy
 *      returned an error (non-finite observation or output): the fault is latched.
 *   3. Latched fault: FALLBACK when in flight (stock PID flies on; the firmware's supervisor then
 *      levels out after 500 ms and stops the motors after 2 s without setpoints), IDLE on the ground.
 *   4. Stale setpoint without a fault (nothing was streamed yet, or the PID was flying a
 *      non-position setpoint): IDLE on the ground, FALLBACK in flight (stock behaviour).
 *   5. Fresh setpoint that is not an absolute x/y/z position (attitude, velocity, ...): FALLBACK,
 *      the policy only knows how to reach a position.
 *   6. Fresh position setpoint: POLICY. On engaging, policy_reset() is called, the previous-action
 *      observation starts at the hover action (as in training) and the policy runs at once, then
 *      every steps_per_period stabilizer steps counted from that step.
 *
 * On the step FALLBACK begins (from POLICY or from IDLE), fallback_takeover is set: the stock PID has
 * been running open-loop (output discarded), beside the policy its integrators hold the integral of
 * the policy's tracking error, not a trim of its own loop. The adapter resets them to the current
 * state and runs the PID's loops at once before its output is used, as the PID resets itself when
 * the setpoint mode changes.
 */
#ifndef CF_POLICY_GLUE_H
#define CF_POLICY_GLUE_H

#include <stdbool.h>
#include <stdint.h>

/* Setpoints older than this stop the policy: inside the firmware's own 500 ms commander watchdog,
 * so the handover to the PID happens before the supervisor starts levelling out. */
#define CFP_DEADMAN_MS 300u

#define CFP_OBS_DIM 22
#define CFP_ACT_DIM 4 /* = number of motors, order M1 front-right, M2 back-right, M3 back-left, M4 front-left */

/* Observation layout (sim/crazyflie/contract.py). */
#define CFP_OBS_POS 0   /* position - reference, world, m */
#define CFP_OBS_ROT 3   /* rotation matrix body->world, row-major */
#define CFP_OBS_VEL 12  /* velocity - reference velocity, world, m/s */
#define CFP_OBS_OMEGA 15 /* angular velocity, body FLU, rad/s */
#define CFP_OBS_PREV 18 /* previous action */

typedef int (*cfp_policy_step_fn)(const float obs[CFP_OBS_DIM], float action[CFP_ACT_DIM]);
typedef void (*cfp_policy_reset_fn)(void);

typedef struct {
  cfp_policy_step_fn policy_step;   /* returns 0 and action in [-1, 1], nonzero on error */
  cfp_policy_reset_fn policy_reset;
  float rpm_max;       /* rotor speed at action +1, rpm (contract) */
  float kf;            /* rotor thrust per rpm^2, N/rpm^2 (the model the policy was trained on) */
  float thrust_max;    /* per-motor thrust at normalized force 1, N (firmware THRUST_MAX) */
  float thrust_min;    /* per-motor thrust below which the firmware stops the motor, N (THRUST_MIN with
                        * CONFIG_ENABLE_THRUST_BAT_COMPENSATED, motors.c; 0 where nothing is cut) */
  float hover_action;  /* previous-action observation when the policy engages */
  uint32_t deadman_ms; /* setpoint age at which a flying policy lets go, ms */
  uint32_t steps_per_period; /* stabilizer steps per policy period (10 at the 1 kHz main loop) */
} cfp_config_t;

typedef enum {
  CFP_SETPOINT_STOP = 0,     /* x/y/z not controlled and zero thrust: cut the motors */
  CFP_SETPOINT_POSITION = 1, /* absolute x, y and z position */
  CFP_SETPOINT_OTHER = 2     /* anything else the stock controller can fly */
} cfp_setpoint_kind_t;

typedef struct {
  uint32_t now_ms;     /* current time, ms (same clock as setpoint_ms, may wrap) */
  uint32_t step;       /* stabilizer step (counts main-loop periods, may wrap) */
  bool in_flight;      /* the firmware thinks it is flying (supervisorIsFlying) */
  float pos[3];        /* estimated position, world ENU, m */
  float quat[4];       /* estimated attitude w, x, y, z, body->world */
  float vel[3];        /* estimated velocity, world, m/s */
  float gyro_dps[3];   /* gyro, body FLU, deg/s (firmware sensorData_t units) */
  cfp_setpoint_kind_t setpoint_kind;
  float setpoint_pos[3]; /* reference position, world, m */
  float setpoint_vel[3]; /* reference velocity, world, m/s */
  uint32_t setpoint_ms;  /* when the commander received the setpoint, ms */
} cfp_input_t;

typedef enum { CFP_IDLE = 0, CFP_POLICY = 1, CFP_FALLBACK = 2 } cfp_mode_t;

typedef enum {
  CFP_FAULT_NONE = 0,
  CFP_FAULT_DEADMAN = 1, /* setpoints stopped while the policy was flying */
  CFP_FAULT_POLICY = 2   /* policy_step returned an error */
} cfp_fault_t;

typedef struct {
  cfp_config_t cfg;
  cfp_mode_t mode;
  cfp_fault_t fault;     /* latched fault, CFP_FAULT_NONE when the policy may engage */
  int policy_rc;         /* last policy_step return code */
  uint32_t policy_steps; /* policy evaluations since init */
  uint32_t engage_step;  /* stabilizer step the policy last engaged on: its periods count from there */
  float obs[CFP_OBS_DIM];       /* last observation given to the policy */
  float action[CFP_ACT_DIM];    /* last action as applied (saturated at action_max), held between periods */
  float action_max;             /* the action whose rotor speed gives normalized force 1 (thrust_max): a
                                 * larger one saturates there, and is fed back as this one */
  float motor_force[CFP_ACT_DIM]; /* normalized force 0..1 per motor, valid in IDLE and POLICY */
  bool fallback_takeover; /* true on the step FALLBACK begins: the adapter resets the stock PID then */
} cfp_t;

void cfp_init(cfp_t *c, const cfp_config_t *cfg);

/* cfp_init for a glue initialised before, keeping a latched fault: the firmware initialises its
 * controller again when stabilizer.controller is written (with CONFIG_CONTROLLER_OOT some versions
 * re-initialise this one whatever was written), and that must not re-arm the policy without the
 * operator's stop. */
void cfp_reinit(cfp_t *c, const cfp_config_t *cfg);

/* One stabilizer step: decide the mode and, in POLICY mode, update motor_force. */
cfp_mode_t cfp_update(cfp_t *c, const cfp_input_t *in);

/* Unit quaternion (w, x, y, z) body->world to the row-major rotation matrix body->world.
 * The quaternion is normalized first; a zero or non-finite one gives non-finite entries,
 * which the policy rejects. */
void cfp_quat_to_rotmat(const float q[4], float r[9]);

/* deg/s -> rad/s */
float cfp_deg_to_rad(float deg);

/* The contract observation from the inputs and the previous action. */
void cfp_build_obs(const cfp_input_t *in, const float prev_action[CFP_ACT_DIM], float obs[CFP_OBS_DIM]);

/* Action in [-1, 1] -> normalized motor force in [0, 1]:
 * rpm = (a + 1) / 2 * rpm_max, thrust = kf * rpm^2 (N), force = thrust / thrust_max, clamped; 0 where
 * thrust < thrust_min (the firmware stops that motor). */
float cfp_action_to_force(const cfp_config_t *cfg, float action);

#endif
