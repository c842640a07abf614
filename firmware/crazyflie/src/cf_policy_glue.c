/* Firmware-independent half of the Crazyflie policy controller: see cf_policy_glue.h. */
#include "cf_policy_glue.h"

#include <math.h>

#define DEG_TO_RAD 0.017453292519943295f

void cfp_init(cfp_t *c, const cfp_config_t *cfg)
{
  c->cfg = *cfg;
  if (c->cfg.steps_per_period == 0u) {
    c->cfg.steps_per_period = 1u; /* a zero period would divide by zero: run on every step */
  }
  c->mode = CFP_IDLE;
  c->fault = CFP_FAULT_NONE;
  c->policy_rc = 0;
  c->policy_steps = 0;
  c->engage_step = 0;
  /* rpm at which kf rpm^2 = thrust_max, as an action: (a + 1) / 2 * rpm_max = rpm */
  const float action_max = 2.0f * sqrtf(cfg->thrust_max / cfg->kf) / cfg->rpm_max - 1.0f;
  c->action_max = action_max < 1.0f ? action_max : 1.0f;
  c->fallback_takeover = false;
  for (int i = 0; i < CFP_OBS_DIM; ++i) {
    c->obs[i] = 0.0f;
  }
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    c->action[i] = cfg->hover_action;
    c->motor_force[i] = 0.0f;
  }
}

void cfp_reinit(cfp_t *c, const cfp_config_t *cfg)
{
  const cfp_fault_t fault = c->fault;
  cfp_init(c, cfg);
  c->fault = fault;
}

float cfp_deg_to_rad(float deg)
{
  return deg * DEG_TO_RAD;
}

void cfp_quat_to_rotmat(const float q[4], float r[9])
{
  const float w = q[0], x = q[1], y = q[2], z = q[3];
  /* s = 2 / |q|^2 makes the matrix orthonormal for any nonzero quaternion: estimators keep the
   * quaternion close to unit length but not exactly, and no square root is needed. */
  const float s = 2.0f / (w * w + x * x + y * y + z * z);
  r[0] = 1.0f - s * (y * y + z * z);
  r[1] = s * (x * y - w * z);
  r[2] = s * (x * z + w * y);
  r[3] = s * (x * y + w * z);
  r[4] = 1.0f - s * (x * x + z * z);
  r[5] = s * (y * z - w * x);
  r[6] = s * (x * z - w * y);
  r[7] = s * (y * z + w * x);
  r[8] = 1.0f - s * (x * x + y * y);
}

void cfp_build_obs(const cfp_input_t *in, const float prev_action[CFP_ACT_DIM], float obs[CFP_OBS_DIM])
{
  for (int i = 0; i < 3; ++i) {
    obs[CFP_OBS_POS + i] = in->pos[i] - in->setpoint_pos[i];
    obs[CFP_OBS_VEL + i] = in->vel[i] - in->setpoint_vel[i];
    obs[CFP_OBS_OMEGA + i] = cfp_deg_to_rad(in->gyro_dps[i]);
  }
  cfp_quat_to_rotmat(in->quat, &obs[CFP_OBS_ROT]);
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    obs[CFP_OBS_PREV + i] = prev_action[i];
  }
}

float cfp_action_to_force(const cfp_config_t *cfg, float action)
{
  const float a = action > 1.0f ? 1.0f : (action < -1.0f ? -1.0f : action);
  const float rpm = 0.5f * (a + 1.0f) * cfg->rpm_max;
  const float thrust = cfg->kf * rpm * rpm;
  if (thrust < cfg->thrust_min) {
    return 0.0f;
  }
  const float force = thrust / cfg->thrust_max;
  return force > 1.0f ? 1.0f : force;
}

static void motors_off(cfp_t *c)
{
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    c->motor_force[i] = 0.0f;
  }
}

/* Evaluates the policy; returns false (and latches the fault) on a policy error. */
static bool run_policy(cfp_t *c, const cfp_input_t *in)
{
  float action[CFP_ACT_DIM];
  cfp_build_obs(in, c->action, c->obs);
  c->policy_rc = c->cfg.policy_step(c->obs, action);
  c->policy_steps++;
  if (c->policy_rc != 0) {
    c->fault = CFP_FAULT_POLICY;
    return false;
  }
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    /* The previous action the policy observes is the one the motors got, as in training (there the
     * clip to [-1, 1]; here also the firmware's limits: actions above action_max saturate at its force,
     * and below the action of thrust_min the firmware stops the motor, rotor speed 0, action -1). */
    const float a = action[i] > 1.0f ? 1.0f : (action[i] < -1.0f ? -1.0f : action[i]);
    c->motor_force[i] = cfp_action_to_force(&c->cfg, action[i]);
    c->action[i] = c->motor_force[i] == 0.0f ? -1.0f : (a > c->action_max ? c->action_max : a);
  }
  return true;
}

cfp_mode_t cfp_update(cfp_t *c, const cfp_input_t *in)
{
  /* Signed difference: wraps with the 32-bit clock, and a setpoint stamped just after `now` was
   * sampled counts as fresh. */
  const int32_t age_ms = (int32_t)(in->now_ms - in->setpoint_ms);
  const bool fresh = age_ms < (int32_t)c->cfg.deadman_ms;
  const cfp_mode_t previous = c->mode;

  if (in->setpoint_kind == CFP_SETPOINT_STOP) {
    /* The operator's stop is what re-arms the policy after a fault. The firmware's supervisor
     * substitutes its own stop (the zero-initialised null setpoint, stamped 0) in every state that
     * does not allow flight: that one leaves the fault latched. Stamp 0 is tested as such, since the
     * signed age of a stamp 0 counts as fresh in the first deadman_ms after boot and from 2^31 ms
     * of uptime on; a real stop stamped exactly 0 (tick 0, or the 49.7-day wrap) keeps the fault. */
    if (fresh && in->setpoint_ms != 0u) {
      c->fault = CFP_FAULT_NONE;
    }
    c->mode = CFP_IDLE;
  } else {
    if (previous == CFP_POLICY && !fresh) {
      c->fault = CFP_FAULT_DEADMAN;
    }
    if (c->fault != CFP_FAULT_NONE || !fresh) {
      c->mode = in->in_flight ? CFP_FALLBACK : CFP_IDLE;
    } else if (in->setpoint_kind != CFP_SETPOINT_POSITION) {
      c->mode = CFP_FALLBACK;
    } else {
      /* The policy runs on the step it engages and then every steps_per_period steps from there, so
       * its first action is held for a whole period, as in training (a global 100 Hz tick would cut
       * it to 1..10 ms). The unsigned difference counts the steps exactly across the counter's wrap;
       * only a single engagement longer than 2^32 steps (49.7 days at 1 kHz) would shift the phase. */
      const bool engaging = previous != CFP_POLICY;
      if (engaging) {
        c->engage_step = in->step;
        c->cfg.policy_reset();
        for (int i = 0; i < CFP_ACT_DIM; ++i) {
          c->action[i] = c->cfg.hover_action;
        }
      }
      c->mode = CFP_POLICY;
      const bool period_start = (uint32_t)(in->step - c->engage_step) % c->cfg.steps_per_period == 0u;
      if (period_start && !run_policy(c, in)) {
        c->mode = in->in_flight ? CFP_FALLBACK : CFP_IDLE;
      }
    }
  }

  if (c->mode != CFP_POLICY) {
    motors_off(c);
  }
  c->fallback_takeover = c->mode == CFP_FALLBACK && previous != CFP_FALLBACK;
  return c->mode;
}
