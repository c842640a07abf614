/* Processor-in-the-loop image: the exported policy on an emulated STM32F405.
 *
 * Boot: policy_self_test, reported in a FRAME_BOOT frame and on the semihosting console.
 * Loop: receive a FRAME_OBS (22 floats), run policy_step, answer FRAME_ACTION with the return
 * code, the 4 actions and the SysTick ticks policy_step took (seq echoed); or receive a
 * FRAME_SENSORS (state estimate, gyro and setpoint in the firmware's units), run the onboard
 * controller's glue (cf_policy_glue.c, as controller_oot.c calls it on the vehicle) and answer
 * FRAME_MOTORS with its mode, fault, action and normalized motor forces. Bad frames are answered
 * with FRAME_NACK; FRAME_QUIT ends QEMU through semihosting. */
#include <string.h>

#include "board.h"
#include "frame.h"
#include "policy.h" /* before cf_policy_config.h */
#include "cf_policy_config.h"

/* Per-motor thrust at normalized force 1 of a stock Crazyflie 2.x (THRUST_MAX of the firmware's
 * platform_defaults_cf2.h), N: the glue saturates commands where the vehicle does (actions above
 * ~0.74, firmware/README.md). */
#define CF2_THRUST_MAX 0.1125f
/* and the thrust below which its battery compensation stops a motor (THRUST_MIN, motors.c), N: the glue
 * cuts those commands as the vehicle does (actions below ~-0.27) */
#define CF2_THRUST_MIN 0.02f

/* The stabilizer's rate on the vehicle (RATE_MAIN_LOOP): a FRAME_SENSORS step counts periods of it. */
#define PIL_MAIN_LOOP_HZ 1000u

#define SENSORS_PAYLOAD 90u
#define MOTORS_PAYLOAD 44u

static cfp_t glue;

/* Compile-time check (C99 has no static_assert): an observation fits in one frame. */
typedef char obs_fits_frame[(POLICY_OBS_DIM * 4 <= FRAME_MAX_PAYLOAD) ? 1 : -1];

static void send(uint8_t type, uint8_t seq, const void *payload, uint8_t len)
{
  uint8_t buf[FRAME_MAX_SIZE];
  uart_write(buf, (uint32_t)frame_encode(type, seq, (const uint8_t *)payload, len, buf));
}

static void boot_report(void)
{
  const uint32_t t0 = ticks_now();
  const uint32_t t1 = ticks_now();
  const int32_t rc = policy_self_test(POLICY_SELF_TEST_TOL);
  const uint32_t t2 = ticks_now();
  /* int32 rc, uint32 self-test ticks, uint32 overhead ticks of one measurement, dims, float32 thrust
   * (N) of the glue's normalized motor force 1, float32 thrust (N) below which it stops a motor. */
  uint32_t payload[7];
  const uint32_t overhead = ticks_elapsed(t0, t1);
  const float thrust_max = CF2_THRUST_MAX, thrust_min = CF2_THRUST_MIN;
  memcpy(&payload[0], &rc, 4);
  payload[1] = ticks_elapsed(t1, t2);
  payload[2] = overhead;
  payload[3] = POLICY_OBS_DIM;
  payload[4] = POLICY_ACT_DIM;
  memcpy(&payload[5], &thrust_max, 4);
  memcpy(&payload[6], &thrust_min, 4);
  /* Console first: once the host has the boot frame, the console line is there too. */
  semihost_print(rc == 0 ? "pil: policy self-test passed\n" : "pil: policy self-test FAILED\n");
  send(FRAME_BOOT, 0, payload, sizeof payload);
}

static void answer_obs(const frame_t *f)
{
  float obs[POLICY_OBS_DIM];
  float action[POLICY_ACT_DIM];
  memcpy(obs, f->payload, sizeof obs);
  const uint32_t t0 = ticks_now();
  const int32_t rc = policy_step(obs, action);
  const uint32_t t1 = ticks_now();
  const uint32_t ticks = ticks_elapsed(t0, t1);
  uint8_t payload[4 + 4 * POLICY_ACT_DIM + 4];
  memcpy(&payload[0], &rc, 4);
  memcpy(&payload[4], action, sizeof action);
  memcpy(&payload[4 + sizeof action], &ticks, 4);
  send(FRAME_ACTION, f->seq, payload, sizeof payload);
}

static void answer_sensors(const frame_t *f)
{
  float v[19];
  uint32_t ms[3]; /* now_ms, setpoint_ms, stabilizer step */
  memcpy(v, f->payload, sizeof v);
  memcpy(ms, &f->payload[sizeof v], sizeof ms);
  const uint8_t flags = f->payload[sizeof v + sizeof ms];
  const uint8_t kind = f->payload[sizeof v + sizeof ms + 1];
  cfp_input_t in = {
    .now_ms = ms[0],
    .step = ms[2],
    .in_flight = (flags & 1u) != 0u,
    .setpoint_kind = kind <= (uint8_t)CFP_SETPOINT_OTHER ? (cfp_setpoint_kind_t)kind : CFP_SETPOINT_OTHER,
    .setpoint_ms = ms[1],
  };
  memcpy(in.pos, &v[0], sizeof in.pos);
  memcpy(in.quat, &v[3], sizeof in.quat);
  memcpy(in.vel, &v[7], sizeof in.vel);
  memcpy(in.gyro_dps, &v[10], sizeof in.gyro_dps);
  memcpy(in.setpoint_pos, &v[13], sizeof in.setpoint_pos);
  memcpy(in.setpoint_vel, &v[16], sizeof in.setpoint_vel);
  const uint32_t t0 = ticks_now();
  const cfp_mode_t mode = cfp_update(&glue, &in);
  const uint32_t t1 = ticks_now();
  const uint32_t ticks = ticks_elapsed(t0, t1);
  const int32_t rc = glue.policy_rc;
  uint8_t payload[MOTORS_PAYLOAD] = {0};
  memcpy(&payload[0], &rc, 4);
  payload[4] = (uint8_t)mode;
  payload[5] = (uint8_t)glue.fault;
  memcpy(&payload[8], glue.action, sizeof glue.action);
  memcpy(&payload[24], glue.motor_force, sizeof glue.motor_force);
  memcpy(&payload[40], &ticks, 4);
  send(FRAME_MOTORS, f->seq, payload, sizeof payload);
}

int main(void)
{
  uart_init();
  ticks_init();
  policy_reset();
  const cfp_config_t cfg = cfp_vehicle_config(CF2_THRUST_MAX, CF2_THRUST_MIN, PIL_MAIN_LOOP_HZ);
  cfp_init(&glue, &cfg);
  boot_report();

  frame_parser_t parser;
  frame_parser_init(&parser);
  uint32_t bad_frames = 0;
  for (;;) {
    const frame_parse_result_t r = frame_parser_feed(&parser, uart_read_byte());
    if (r == FRAME_PARSE_MORE) {
      continue;
    }
    const frame_t *f = &parser.frame;
    if (r == FRAME_PARSE_OK && f->type == FRAME_OBS && f->len == POLICY_OBS_DIM * 4) {
      answer_obs(f);
    } else if (r == FRAME_PARSE_OK && f->type == FRAME_SENSORS && f->len == SENSORS_PAYLOAD) {
      answer_sensors(f);
    } else if (r == FRAME_PARSE_OK && f->type == FRAME_QUIT) {
      semihost_print("pil: quit\n");
      semihost_exit(0);
    } else {
      bad_frames++;
      send(FRAME_NACK, r == FRAME_PARSE_OK ? f->seq : 0, &bad_frames, sizeof bad_frames);
    }
  }
}
