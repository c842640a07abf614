/* Host unit tests of cf_policy_glue (observation, units, dead-man, fallback) and of the PIL framing.
 * Built with -std=c99 -Wall -Wextra -Werror -Wdouble-promotion by `make host-test`; exits nonzero
 * on the first failed group and prints every failed check. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cf_policy_glue.h"
#include "frame.h"

static int failures;
static int checks;

#define CHECK(cond)                                                   \
  do {                                                                \
    checks++;                                                         \
    if (!(cond)) {                                                    \
      failures++;                                                     \
      printf("%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                 \
  } while (0)

#define CHECK_NEAR(a, b, tol) CHECK(fabsf((a) - (b)) <= (tol))

/* ---------------------------------------------------------------- fake policy */

static int fake_rc;          /* what the fake policy returns */
static int fake_calls;       /* policy_step calls */
static int fake_resets;      /* policy_reset calls */
static float fake_last_obs[CFP_OBS_DIM];
static float fake_action0;   /* if nonzero, motor 1's action instead */

static int fake_step(const float obs[CFP_OBS_DIM], float action[CFP_ACT_DIM])
{
  fake_calls++;
  memcpy(fake_last_obs, obs, sizeof fake_last_obs);
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    /* Distinct per motor and per call, so held actions and previous-action feedback show. */
    action[i] = fake_rc == 0 ? 0.1f * (float)(i + 1) + 0.01f * (float)fake_calls : -1.0f;
  }
  if (fake_action0 != 0.0f) {
    action[0] = fake_action0;
  }
  return fake_rc;
}

static void fake_reset(void)
{
  fake_resets++;
}

static const cfp_config_t config = {
  .policy_step = fake_step,
  .policy_reset = fake_reset,
  .rpm_max = 21702.0f,
  .kf = 3.16e-10f,
  .thrust_max = 0.1125f,
  .thrust_min = 0.02f, /* the CF2's THRUST_MIN */
  .hover_action = 0.334f,
  .deadman_ms = 300u,
  .steps_per_period = 10u, /* a 1 kHz stabilizer, a 10 ms policy period */
};

static void reset_fake(int rc)
{
  fake_rc = rc;
  fake_calls = 0;
  fake_resets = 0;
}

/* Hovering 1 m up, level, a fresh position setpoint at the current time; the stabilizer's step is
 * the ms clock (1 kHz). */
static cfp_input_t hover_input(uint32_t now_ms)
{
  cfp_input_t in;
  memset(&in, 0, sizeof in);
  in.now_ms = now_ms;
  in.step = now_ms;
  in.in_flight = true;
  in.pos[2] = 1.0f;
  in.quat[0] = 1.0f;
  in.setpoint_kind = CFP_SETPOINT_POSITION;
  in.setpoint_pos[2] = 1.0f;
  in.setpoint_ms = now_ms;
  return in;
}

static bool motors_off(const cfp_t *c)
{
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    if (c->motor_force[i] != 0.0f) {
      return false;
    }
  }
  return true;
}

/* ---------------------------------------------------------------- tests */

static void test_quat_to_rotmat(void)
{
  float r[9];
  const float identity[4] = {1.0f, 0.0f, 0.0f, 0.0f};
  cfp_quat_to_rotmat(identity, r);
  for (int i = 0; i < 9; ++i) {
    CHECK_NEAR(r[i], (i % 4 == 0) ? 1.0f : 0.0f, 1e-7f);
  }

  /* 90 deg yaw: body x (forward) points to world y. Row-major: column 0 is body x in world. */
  const float h = 0.70710678f;
  const float yaw90[4] = {h, 0.0f, 0.0f, h};
  const float yaw90_r[9] = {0, -1, 0, 1, 0, 0, 0, 0, 1};
  cfp_quat_to_rotmat(yaw90, r);
  for (int i = 0; i < 9; ++i) {
    CHECK_NEAR(r[i], yaw90_r[i], 1e-6f);
  }

  /* A general attitude, reference from sim/crazyflie/dynamics.py quat_to_rotmat. */
  const float q[4] = {0.8f, 0.2f, -0.4f, 0.4f};
  const float q_r[9] = {0.36f, -0.8f, -0.48f, 0.48f, 0.6f, -0.64f, 0.8f, 0.0f, 0.6f};
  cfp_quat_to_rotmat(q, r);
  for (int i = 0; i < 9; ++i) {
    CHECK_NEAR(r[i], q_r[i], 1e-6f);
  }

  /* Estimators drift off unit length: a scaled quaternion is the same rotation. */
  const float q_scaled[4] = {0.8f * 1.01f, 0.2f * 1.01f, -0.4f * 1.01f, 0.4f * 1.01f};
  cfp_quat_to_rotmat(q_scaled, r);
  for (int i = 0; i < 9; ++i) {
    CHECK_NEAR(r[i], q_r[i], 1e-6f);
  }

  /* A zero quaternion must not look like a valid attitude. */
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  cfp_quat_to_rotmat(zero, r);
  CHECK(!isfinite(r[0]));
}

static void test_units_and_observation(void)
{
  CHECK_NEAR(cfp_deg_to_rad(180.0f), 3.14159265f, 1e-6f);
  CHECK_NEAR(cfp_deg_to_rad(-57.2957795f), -1.0f, 1e-6f);

  cfp_input_t in = hover_input(0);
  const float pos[3] = {0.1f, -0.2f, 1.3f};
  const float sp_pos[3] = {0.0f, 0.5f, 1.0f};
  const float vel[3] = {0.5f, 0.0f, -0.25f};
  const float sp_vel[3] = {0.25f, 0.0f, 0.0f};
  const float gyro_dps[3] = {90.0f, -180.0f, 45.0f};
  memcpy(in.pos, pos, sizeof pos);
  memcpy(in.setpoint_pos, sp_pos, sizeof sp_pos);
  memcpy(in.vel, vel, sizeof vel);
  memcpy(in.setpoint_vel, sp_vel, sizeof sp_vel);
  memcpy(in.gyro_dps, gyro_dps, sizeof gyro_dps);
  const float prev[CFP_ACT_DIM] = {0.1f, 0.2f, 0.3f, 0.4f};
  float obs[CFP_OBS_DIM];
  cfp_build_obs(&in, prev, obs);
  for (int i = 0; i < 3; ++i) {
    CHECK_NEAR(obs[CFP_OBS_POS + i], pos[i] - sp_pos[i], 1e-6f);
    CHECK_NEAR(obs[CFP_OBS_VEL + i], vel[i] - sp_vel[i], 1e-6f);
  }
  CHECK_NEAR(obs[CFP_OBS_OMEGA + 0], 1.5707963f, 1e-6f);
  CHECK_NEAR(obs[CFP_OBS_OMEGA + 1], -3.1415927f, 1e-6f);
  CHECK_NEAR(obs[CFP_OBS_OMEGA + 2], 0.7853982f, 1e-6f);
  CHECK_NEAR(obs[CFP_OBS_ROT + 0], 1.0f, 1e-7f);
  CHECK_NEAR(obs[CFP_OBS_ROT + 8], 1.0f, 1e-7f);
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    CHECK(obs[CFP_OBS_PREV + i] == prev[i]);
  }
}

static void test_action_to_force(void)
{
  CHECK(cfp_action_to_force(&config, -1.0f) == 0.0f);
  CHECK(cfp_action_to_force(&config, -5.0f) == 0.0f);
  /* Hover: kf * hover_rpm^2 = m g / 4 = 0.0662 N of the 0.1125 N per-motor maximum. */
  const float hover = cfp_action_to_force(&config, 0.33405300f);
  CHECK_NEAR(hover, 0.0662175f / 0.1125f, 1e-4f);
  /* Above the firmware's THRUST_MAX the command saturates. */
  CHECK(cfp_action_to_force(&config, 1.0f) == 1.0f);
  CHECK(cfp_action_to_force(&config, 0.9f) == 1.0f);
  CHECK(cfp_action_to_force(&config, 0.5f) < 1.0f);
  /* Below the firmware's THRUST_MIN (0.02 N: action -0.267) the motor is stopped, above it is not. */
  CHECK(cfp_action_to_force(&config, -0.28f) == 0.0f);
  CHECK_NEAR(cfp_action_to_force(&config, -0.26f), 0.0204f / 0.1125f, 1e-3f);
  cfp_config_t uncut = config;
  uncut.thrust_min = 0.0f; /* firmware without the battery compensation: nothing cut */
  CHECK(cfp_action_to_force(&uncut, -0.28f) > 0.1f);
  float last = 0.0f;
  for (int i = 0; i <= 20; ++i) {
    const float f = cfp_action_to_force(&config, -1.0f + 0.1f * (float)i);
    CHECK(f >= last);
    last = f;
  }
}

static void test_engage_and_hold(void)
{
  cfp_t c;
  reset_fake(0);
  cfp_init(&c, &config);
  CHECK(c.mode == CFP_IDLE);

  /* Engaging runs the policy at once, on any step, with the hover action as previous action. */
  cfp_input_t in = hover_input(1003);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_resets == 1);
  CHECK(fake_calls == 1);
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    CHECK(fake_last_obs[CFP_OBS_PREV + i] == config.hover_action);
    CHECK(c.motor_force[i] == cfp_action_to_force(&config, c.action[i]));
  }
  const float held = c.motor_force[0];

  /* The action is held for a whole period counted from the engaging step, also across the step a
   * free-running 100 Hz tick would fire on (1010): the first action lasts 10 ms, as in training. */
  for (uint32_t step = 1004; step < 1013; ++step) {
    in = hover_input(step);
    CHECK(cfp_update(&c, &in) == CFP_POLICY);
  }
  CHECK(fake_calls == 1);
  CHECK(c.motor_force[0] == held);

  /* On the next tick the previous action fed back is the one being applied. */
  float applied[CFP_ACT_DIM];
  memcpy(applied, c.action, sizeof applied);
  in = hover_input(1013);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_calls == 2);
  CHECK(fake_resets == 1);
  for (int i = 0; i < CFP_ACT_DIM; ++i) {
    CHECK(fake_last_obs[CFP_OBS_PREV + i] == applied[i]);
  }
  CHECK(c.motor_force[0] != held);

  /* An action above the firmware's force limit saturates there, and the previous action fed back is
   * the one the motor got (the action of rpm sqrt(thrust_max / kf): 0.739 for the stock 0.1125 N). */
  const float action_max = 2.0f * sqrtf(config.thrust_max / config.kf) / config.rpm_max - 1.0f;
  CHECK_NEAR(c.action_max, action_max, 1e-6f);
  CHECK_NEAR(c.action_max, 0.7389f, 1e-3f);
  fake_action0 = 0.95f;
  in = hover_input(1023);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(c.motor_force[0] == 1.0f && c.action[0] == c.action_max && c.action[1] < c.action_max);
  in = hover_input(1033);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_last_obs[CFP_OBS_PREV] == c.action_max);
  /* An action below the one of THRUST_MIN (-0.267) stops the motor, on the vehicle (motors.c) as here,
   * and is fed back as -1, what the motor got; one just above it is applied and fed back as it is. */
  const float action_min = 2.0f * sqrtf(config.thrust_min / config.kf) / config.rpm_max - 1.0f;
  CHECK_NEAR(action_min, -0.2667f, 1e-3f);
  CHECK(cfp_action_to_force(&config, action_min - 1e-4f) == 0.0f);
  CHECK(cfp_action_to_force(&config, action_min + 1e-4f) > 0.0f);
  fake_action0 = -0.5f;
  in = hover_input(1043);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(c.motor_force[0] == 0.0f && c.action[0] == -1.0f && c.motor_force[1] > 0.0f);
  fake_action0 = -0.25f;
  in = hover_input(1053);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_last_obs[CFP_OBS_PREV] == -1.0f);
  CHECK(c.motor_force[0] > 0.0f && c.action[0] == -0.25f);
  in = hover_input(1063);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_last_obs[CFP_OBS_PREV] == -0.25f);
  fake_action0 = 0.0f;

  /* Periods count exactly across the stabilizer step counter's wrap (2^32 steps). */
  cfp_init(&c, &config);
  const int before = fake_calls;
  for (uint32_t k = 0; k <= 20u; ++k) {
    in = hover_input(1100u + k);
    in.step = 0xFFFFFFFCu + k;
    CHECK(cfp_update(&c, &in) == CFP_POLICY);
    CHECK(fake_calls == before + 1 + (int)(k / 10u));
  }
}

static void test_deadman(void)
{
  cfp_t c;
  reset_fake(0);
  cfp_init(&c, &config);

  CHECK(!c.fallback_takeover);

  /* No setpoint streamed yet (stale) on the ground: idle, and that is no fault. */
  cfp_input_t in = hover_input(5000);
  in.setpoint_ms = 0;
  in.in_flight = false;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(c.fault == CFP_FAULT_NONE);
  CHECK(fake_calls == 0);
  CHECK(!c.fallback_takeover);
  /* The same in flight (e.g. after a take-off on attitude setpoints): the PID flies on, taking over
   * from idle on this step. */
  in.in_flight = true;
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(c.fault == CFP_FAULT_NONE);
  CHECK(c.fallback_takeover);
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(!c.fallback_takeover);

  /* Flying on the policy, then setpoints stop at t = 10000 ms. */
  in = hover_input(10000);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  in.now_ms = 10000u + config.deadman_ms - 1u;
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(!c.fallback_takeover);
  in.now_ms = 10000u + config.deadman_ms;
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(c.fault == CFP_FAULT_DEADMAN);
  CHECK(motors_off(&c)); /* the PID drives now; the glue's own command is off */
  CHECK(c.fallback_takeover); /* the adapter resets the PID on this step only */

  /* Setpoints come back: the fault stays latched, the PID keeps flying. */
  in = hover_input(10500);
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(!c.fallback_takeover);
  /* Landed (supervisor no longer flying): motors idle. */
  in.in_flight = false;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(!c.fallback_takeover);
  /* The supervisor's null setpoint (a stop stamped 0, e.g. after its 2 s commander timeout) cuts
   * the motors but is not the operator's stop: the fault stays, and returning position
   * setpoints do not re-engage the policy. */
  in.setpoint_kind = CFP_SETPOINT_STOP;
  in.setpoint_ms = 0;
  in.now_ms = 10550;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(c.fault == CFP_FAULT_DEADMAN);
  CHECK(motors_off(&c));
  in = hover_input(10600);
  in.in_flight = false;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(c.fault == CFP_FAULT_DEADMAN);
  /* Also where the signed age of stamp 0 is small or negative: just after boot, from 2^31 ms of
   * uptime on, and just before the 32-bit clock wraps. */
  const uint32_t nows[] = {100u, 0x80000000u, 0xC0000000u, 0xFFFFFF00u};
  for (unsigned k = 0; k < sizeof nows / sizeof nows[0]; ++k) {
    in.setpoint_kind = CFP_SETPOINT_STOP;
    in.setpoint_ms = 0;
    in.now_ms = nows[k];
    CHECK(cfp_update(&c, &in) == CFP_IDLE);
    CHECK(c.fault == CFP_FAULT_DEADMAN);
  }
  /* The firmware initialising its controller again (stabilizer.controller written) keeps the fault. */
  cfp_reinit(&c, &config);
  CHECK(c.fault == CFP_FAULT_DEADMAN && c.mode == CFP_IDLE);
  in = hover_input(10600);
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  in = hover_input(10600);
  in.in_flight = false;
  /* Only a stop setpoint re-arms the policy. */
  in.setpoint_kind = CFP_SETPOINT_STOP;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(c.fault == CFP_FAULT_NONE);
  in = hover_input(11000);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);

  /* The same timeout on the ground goes straight to idle. */
  in = hover_input(20000);
  in.in_flight = false;
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  in.now_ms = 20000u + config.deadman_ms;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(c.fault == CFP_FAULT_DEADMAN);
  CHECK(motors_off(&c));

  /* The millisecond clock wraps after 49.7 days. */
  cfp_init(&c, &config);
  in = hover_input(0xFFFFFF00u);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  in.now_ms = 0xFFFFFF00u + 200u; /* wrapped, 200 ms old */
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  in.now_ms = 0xFFFFFF00u + 400u; /* wrapped, 400 ms old */
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
}

static void test_policy_error(void)
{
  cfp_t c;
  reset_fake(0);
  cfp_init(&c, &config);
  cfp_input_t in = hover_input(1000);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);

  /* Error in flight: hand over to the PID in the same step. */
  fake_rc = 2;
  in = hover_input(1010);
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(c.fault == CFP_FAULT_POLICY);
  CHECK(c.policy_rc == 2);
  CHECK(motors_off(&c));
  CHECK(c.fallback_takeover);

  /* Latched: the policy is not run again even if it would now succeed. */
  fake_rc = 0;
  const int calls = fake_calls;
  in = hover_input(1020);
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(fake_calls == calls);
  CHECK(!c.fallback_takeover);

  /* Error on the ground (e.g. a non-finite estimate before take-off): motors stay off. */
  in.setpoint_kind = CFP_SETPOINT_STOP;
  cfp_update(&c, &in);
  fake_rc = 1;
  in = hover_input(2000);
  in.in_flight = false;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(c.fault == CFP_FAULT_POLICY);
  CHECK(motors_off(&c));

  /* A non-finite estimate reaches the policy unchanged, so the real policy_step rejects it. */
  fake_rc = 0;
  in.setpoint_kind = CFP_SETPOINT_STOP;
  cfp_update(&c, &in);
  in = hover_input(3000);
  in.pos[0] = NAN;
  cfp_update(&c, &in);
  CHECK(isnan(fake_last_obs[CFP_OBS_POS]));
}

static void test_other_setpoints(void)
{
  cfp_t c;
  reset_fake(0);
  cfp_init(&c, &config);
  cfp_input_t in = hover_input(1000);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);

  /* A velocity or attitude setpoint is flown by the PID, without a fault. */
  in = hover_input(1010);
  in.setpoint_kind = CFP_SETPOINT_OTHER;
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(c.fault == CFP_FAULT_NONE);
  CHECK(c.fallback_takeover);
  in.now_ms = 1011;
  CHECK(cfp_update(&c, &in) == CFP_FALLBACK);
  CHECK(!c.fallback_takeover);

  /* Position setpoints again: the policy re-engages from a reset state, at once, and its periods
   * count from the new engaging step. */
  const int calls = fake_calls;
  in = hover_input(1027);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_resets == 2);
  CHECK(fake_calls == calls + 1);
  CHECK(fake_last_obs[CFP_OBS_PREV] == config.hover_action);
  in = hover_input(1030);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_calls == calls + 1);
  in = hover_input(1037);
  CHECK(cfp_update(&c, &in) == CFP_POLICY);
  CHECK(fake_calls == calls + 2);

  /* A stop setpoint cuts the motors at once, also in flight (as the stock controllers do). */
  in.setpoint_kind = CFP_SETPOINT_STOP;
  CHECK(cfp_update(&c, &in) == CFP_IDLE);
  CHECK(motors_off(&c));
}

static void test_frames(void)
{
  /* CRC-16/CCITT-FALSE check value. */
  CHECK(frame_crc16((const uint8_t *)"123456789", 9) == 0x29B1u);

  uint8_t payload[88];
  for (int i = 0; i < 88; ++i) {
    payload[i] = (uint8_t)(i * 7);
  }
  uint8_t buf[FRAME_MAX_SIZE];
  const size_t n = frame_encode(FRAME_OBS, 42, payload, sizeof payload, buf);
  CHECK(n == FRAME_HEADER_SIZE + sizeof payload + 2u);
  CHECK(frame_encode(FRAME_OBS, 0, payload, FRAME_MAX_PAYLOAD + 1u, buf) == 0);
  frame_encode(FRAME_OBS, 42, payload, sizeof payload, buf);

  frame_parser_t p;
  frame_parser_init(&p);
  /* Garbage first, including a lone sync byte and a doubled one right before the frame. */
  const uint8_t garbage[] = {0x00, 0x13, FRAME_SYNC0, 0x00, 0xFF, FRAME_SYNC0};
  int oks = 0;
  int bads = 0;
  for (size_t i = 0; i < sizeof garbage; ++i) {
    bads += frame_parser_feed(&p, garbage[i]) == FRAME_PARSE_BAD;
  }
  for (size_t i = 0; i < n; ++i) {
    const frame_parse_result_t r = frame_parser_feed(&p, buf[i]);
    oks += r == FRAME_PARSE_OK;
    bads += r == FRAME_PARSE_BAD;
  }
  CHECK(oks == 1 && bads == 0);
  CHECK(p.frame.type == FRAME_OBS && p.frame.seq == 42 && p.frame.len == 88);
  CHECK(memcmp(p.frame.payload, payload, sizeof payload) == 0);

  /* A corrupted frame is dropped, the next one is received. */
  uint8_t corrupt[FRAME_MAX_SIZE];
  memcpy(corrupt, buf, n);
  corrupt[20] ^= 0x01u;
  oks = bads = 0;
  for (size_t i = 0; i < n; ++i) {
    bads += frame_parser_feed(&p, corrupt[i]) == FRAME_PARSE_BAD;
  }
  for (size_t i = 0; i < n; ++i) {
    oks += frame_parser_feed(&p, buf[i]) == FRAME_PARSE_OK;
  }
  CHECK(bads == 1 && oks == 1);

  /* An impossible length is rejected without waiting for its payload. */
  const uint8_t oversize[] = {FRAME_SYNC0, FRAME_SYNC1, FRAME_OBS, 0, FRAME_MAX_PAYLOAD + 1u};
  bads = 0;
  for (size_t i = 0; i < sizeof oversize; ++i) {
    bads += frame_parser_feed(&p, oversize[i]) == FRAME_PARSE_BAD;
  }
  CHECK(bads == 1);

  /* Empty payload (FRAME_QUIT). */
  const size_t nq = frame_encode(FRAME_QUIT, 7, payload, 0, buf);
  oks = 0;
  for (size_t i = 0; i < nq; ++i) {
    oks += frame_parser_feed(&p, buf[i]) == FRAME_PARSE_OK;
  }
  CHECK(oks == 1 && p.frame.type == FRAME_QUIT && p.frame.len == 0);
}

int main(void)
{
  test_quat_to_rotmat();
  test_units_and_observation();
  test_action_to_force();
  test_engage_and_hold();
  test_deadman();
  test_policy_error();
  test_other_setpoints();
  test_frames();
  printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
