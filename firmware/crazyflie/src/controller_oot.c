/* Out-of-tree controller for the Crazyflie 2.x firmware that flies the exported policy.
 *
 * Thin adapter: firmware types in, cf_policy_glue decides, firmware control_t out. All the logic
 * worth testing (observation, units, dead-man, fallback) lives in cf_policy_glue.c.
 *
 * Motor command: controlModeForce, normalizedForces[i] = kf * rpm_i^2 / THRUST_MAX with
 * rpm_i = (a_i + 1) / 2 * POLICY_RPM_MAX. The firmware maps a normalized force linearly to thrust
 * (0..THRUST_MAX N per motor) and, with CONFIG_ENABLE_THRUST_BAT_COMPENSATED, inverts its
 * measured thrust(voltage) curve and the battery voltage into PWM. kf is the simulator's
 * (sim/crazyflie/params.py) so a command means the thrust the policy was trained to expect.
 * With the stock THRUST_MAX (0.1125 N) actions above ~0.74 saturate at a normalized force of 1 (THRUST_MAX;
 * the PWM that gives it depends on the battery voltage).
 *
 * Fallback: the stock PID controller runs on every step (output discarded while the policy flies).
 * On the step it takes over, its PIDs and filters are reset to the current state first: running
 * open-loop beside the policy, its integrators summed the policy's tracking error. With the CF2's
 * stock gains (platform_defaults_cf2.h: z position kp 2 ki 0.5, z velocity kp 25 ki 15, thrust
 * scale 1000, base 36000) a steady 2 cm below the setpoint, vehicle at rest, reaches full thrust
 * (65535) after about 15 s and the z velocity loop's output limit (32.767, x1000) after about 16 s:
 * the PID would take over climbing at full thrust. That step also runs the PID as at stabilizer
 * step 0, where its position (100 Hz) and attitude (500 Hz) loops both execute: otherwise it would
 * output, until its next position step (up to 9 ms), the thrust and attitude it computed last from
 * the wound-up state.
 */
#include <stdbool.h>
#include <stdint.h>

#include "FreeRTOS.h"
#include "task.h"

#include "app.h"
#include "attitude_controller.h"
#include "controller.h"
#include "controller_pid.h"
#include "estimator.h"
#include "log.h"
#include "platform_defaults.h"
#include "position_controller.h"
#include "stabilizer_types.h"
#include "supervisor.h"

#define DEBUG_MODULE "POLICY"
#include "debug.h"

#include "policy.h" /* before cf_policy_config.h */
#include "cf_policy_config.h"

/* The exported policy must fit this glue: with a header of other sizes the build would still
 * compile (array parameters decay to pointers) and policy_step would read past the observation or
 * leave inputs out. The glue runs it once per POLICY_PERIOD_MS, counted from the step it engages on. */
_Static_assert(POLICY_OBS_DIM == CFP_OBS_DIM, "policy.h: observation size is not the glue's CFP_OBS_DIM");
_Static_assert(POLICY_ACT_DIM == CFP_ACT_DIM && CFP_ACT_DIM == STABILIZER_NR_OF_MOTORS,
               "policy.h: action size is not the glue's CFP_ACT_DIM (one per motor)");
_Static_assert(POLICY_PERIOD_MS == 10, "policy.h: period is not the contract's 10 ms");

#if (RATE_MAIN_LOOP * POLICY_PERIOD_MS) % 1000 != 0
#error "the policy period is not a whole number of stabilizer steps"
#endif

/* The per-motor thrust (N) under which motors.c stops a motor: with the battery compensation it returns
 * 0 below THRUST_MIN (motorsCompensateBatteryVoltage); without it nothing is cut, nor by the older
 * compensation that has no THRUST_MIN (the "65536 <==> 60 grams" fit, firmware/README.md). */
#if defined(CONFIG_ENABLE_THRUST_BAT_COMPENSATED) && defined(THRUST_MIN)
#define MOTOR_THRUST_CUT THRUST_MIN
#else
#define MOTOR_THRUST_CUT 0.0f
#endif

static cfp_t glue;
static control_t pid_control;
static uint8_t log_mode;
static uint8_t log_fault;

void controllerOutOfTreeInit(void)
{
  static bool initialised;
  const cfp_config_t cfg = cfp_vehicle_config(THRUST_MAX, MOTOR_THRUST_CUT, RATE_MAIN_LOOP);
  if (initialised) {
    cfp_reinit(&glue, &cfg); /* a controller switch at runtime: a latched fault stays */
  } else {
    cfp_init(&glue, &cfg);
    initialised = true;
  }
  controllerPidInit();
}

/* Runs once at boot (stabilizerTest): a failure fails the firmware's system self-test, so it will
 * not fly. */
bool controllerOutOfTreeTest(void)
{
  const int rc = policy_self_test(POLICY_SELF_TEST_TOL);
  DEBUG_PRINT("policy self-test %s (rc %d)\n", rc == 0 ? "passed" : "FAILED", rc);
  return rc == 0 && controllerPidTest();
}

/* The policy's observation needs a full position and velocity estimate: the Kalman estimator's. The
 * complementary estimator (the firmware's default without a positioning deck) estimates attitude and
 * height only, so the policy would see a fixed x/y error and no velocity. app-config forces Kalman at
 * boot (CONFIG_ESTIMATOR_KALMAN); after a switch at runtime (stabilizer.estimator) a position setpoint
 * goes to the stock controller, as any setpoint the policy cannot fly does. */
static cfp_setpoint_kind_t setpoint_kind(const setpoint_t *sp)
{
  if (sp->mode.x == modeAbs && sp->mode.y == modeAbs && sp->mode.z == modeAbs) {
    return stateEstimatorGetType() == StateEstimatorTypeKalman ? CFP_SETPOINT_POSITION : CFP_SETPOINT_OTHER;
  }
  if (sp->mode.x == modeDisable && sp->mode.y == modeDisable && sp->mode.z == modeDisable && sp->thrust == 0.0f) {
    return CFP_SETPOINT_STOP;
  }
  return CFP_SETPOINT_OTHER;
}

void controllerOutOfTree(control_t *control, const setpoint_t *setpoint, const sensorData_t *sensors,
                         const state_t *state, const stabilizerStep_t stabilizerStep)
{
  const quaternion_t *q = &state->attitudeQuaternion;
  /* A body-frame velocity reference has no place in the world-frame observation: treat it as 0. */
  const bool world_vel = !setpoint->velocity_body;
  const cfp_input_t in = {
    .now_ms = T2M(xTaskGetTickCount()),
    .step = stabilizerStep,
    .in_flight = supervisorIsFlying(),
    .pos = {state->position.x, state->position.y, state->position.z},
    .quat = {q->w, q->x, q->y, q->z},
    .vel = {state->velocity.x, state->velocity.y, state->velocity.z},
    .gyro_dps = {sensors->gyro.x, sensors->gyro.y, sensors->gyro.z},
    .setpoint_kind = setpoint_kind(setpoint),
    .setpoint_pos = {setpoint->position.x, setpoint->position.y, setpoint->position.z},
    .setpoint_vel = {world_vel ? setpoint->velocity.x : 0.0f, world_vel ? setpoint->velocity.y : 0.0f,
                     world_vel ? setpoint->velocity.z : 0.0f},
    .setpoint_ms = T2M(setpoint->timestamp),
  };

  const cfp_mode_t mode = cfp_update(&glue, &in);
  log_mode = (uint8_t)mode;
  log_fault = (uint8_t)glue.fault;
  if (glue.fallback_takeover) {
    /* What controller_pid.c does itself on a setpoint-mode change (its controllerResetAllPids). */
    positionControllerResetAllPID(state->position.x, state->position.y, state->position.z);
    positionControllerResetAllfilters();
    attitudeControllerResetAllPID(state->attitude.roll, state->attitude.pitch, state->attitude.yaw);
  }
  controllerPid(&pid_control, setpoint, sensors, state, glue.fallback_takeover ? 0 : stabilizerStep);
  if (mode == CFP_FALLBACK) {
    *control = pid_control;
    return;
  }
  control->controlMode = controlModeForce;
  for (int i = 0; i < STABILIZER_NR_OF_MOTORS; ++i) {
    control->normalizedForces[i] = glue.motor_force[i];
  }
}

/* The app task reports mode changes on the console: printing from the 1 kHz stabilizer loop
 * would disturb its timing. */
void appMain(void)
{
  uint8_t reported_mode = CFP_IDLE;
  uint8_t reported_fault = CFP_FAULT_NONE;
  while (1) {
    vTaskDelay(M2T(100));
    if (log_mode != reported_mode || log_fault != reported_fault) {
      reported_mode = log_mode;
      reported_fault = log_fault;
      DEBUG_PRINT("mode %u (0 idle, 1 policy, 2 PID fallback), fault %u (1 dead-man, 2 policy error)\n",
                  reported_mode, reported_fault);
    }
  }
}

/* Log group "rlpolicy": who drives the motors and why, plus the last action. */
LOG_GROUP_START(rlpolicy)
LOG_ADD(LOG_UINT8, mode, &log_mode)
LOG_ADD(LOG_UINT8, fault, &log_fault)
LOG_ADD(LOG_INT32, rc, &glue.policy_rc)
LOG_ADD(LOG_FLOAT, a1, &glue.action[0])
LOG_ADD(LOG_FLOAT, a2, &glue.action[1])
LOG_ADD(LOG_FLOAT, a3, &glue.action[2])
LOG_ADD(LOG_FLOAT, a4, &glue.action[3])
LOG_GROUP_STOP(rlpolicy)
