/* Binary framing of the processor-in-the-loop link (C99, no heap). firmware/pil.py speaks the
 * same format.
 *
 *   offset  size  field
 *   0       2     sync 0xA5 0x5A
 *   2       1     type (FRAME_OBS, FRAME_ACTION, ...)
 *   3       1     seq: chosen by the host, echoed in the reply
 *   4       1     len: payload bytes, <= FRAME_MAX_PAYLOAD
 *   5       len   payload, little-endian
 *   5+len   2     CRC-16/CCITT-FALSE (poly 0x1021, init 0xFFFF) over bytes 2 .. 4+len, little-endian
 *
 * A receiver that loses sync (garbage, a dropped byte, a bad CRC) hunts for the next sync pair;
 * the frame in which the error happened is lost, the following ones are received.
 */
#ifndef FRAME_H
#define FRAME_H

#include <stddef.h>
#include <stdint.h>

#define FRAME_SYNC0 0xA5u
#define FRAME_SYNC1 0x5Au
#define FRAME_HEADER_SIZE 5u
#define FRAME_MAX_PAYLOAD 96u
#define FRAME_MAX_SIZE (FRAME_HEADER_SIZE + FRAME_MAX_PAYLOAD + 2u)

/* Frame types. */
#define FRAME_OBS 'O'    /* host -> MCU: float32 obs[22] */
#define FRAME_ACTION 'A' /* MCU -> host: int32 rc, float32 action[4], uint32 SysTick ticks of policy_step */
#define FRAME_BOOT 'B'   /* MCU -> host: int32 self-test rc, uint32 self-test ticks, uint32 timer overhead
                          * ticks, uint32 obs dim, uint32 action dim, float32 thrust (N) of the glue's
                          * normalized motor force 1, float32 thrust (N) below which it stops a motor */
#define FRAME_NACK 'N'   /* MCU -> host: uint32 number of bad frames so far (bad CRC, size or type) */
#define FRAME_QUIT 'Q'   /* host -> MCU: no payload; the image exits through semihosting */
/* The onboard controller's glue (crazyflie/src/cf_policy_glue.c) between them, in firmware units:
 * host -> MCU: float32 pos[3] (m), quat[4] (w, x, y, z), vel[3] (m/s), gyro[3] (deg/s), setpoint
 * pos[3], setpoint vel[3]; uint32 now_ms, setpoint_ms, stabilizer step (1 kHz: the host sends
 * now_ms); uint8 flags (bit 0 in flight), uint8 setpoint kind (cfp_setpoint_kind_t): 90 bytes. */
#define FRAME_SENSORS 'S'
/* MCU -> host: int32 policy rc, uint8 mode (cfp_mode_t), uint8 fault (cfp_fault_t), 2 zero bytes,
 * float32 action[4], float32 normalized motor force[4], uint32 SysTick ticks of cfp_update: 44 bytes. */
#define FRAME_MOTORS 'M'

typedef struct {
  uint8_t type;
  uint8_t seq;
  uint8_t len;
  uint8_t payload[FRAME_MAX_PAYLOAD];
} frame_t;

typedef enum { FRAME_PARSE_MORE = 0, FRAME_PARSE_OK = 1, FRAME_PARSE_BAD = 2 } frame_parse_result_t;

typedef struct {
  int state;      /* which field the next byte belongs to */
  uint8_t got;    /* payload bytes received */
  uint8_t crc_lo; /* first CRC byte */
  frame_t frame;  /* the frame being received; complete after FRAME_PARSE_OK */
} frame_parser_t;

uint16_t frame_crc16(const uint8_t *data, size_t n);

/* Writes the frame to out (FRAME_MAX_SIZE bytes) and returns its size, 0 if len is too large. */
size_t frame_encode(uint8_t type, uint8_t seq, const uint8_t *payload, uint8_t len, uint8_t out[FRAME_MAX_SIZE]);

void frame_parser_init(frame_parser_t *p);

/* Feeds one received byte. FRAME_PARSE_OK: p->frame holds a frame with a valid CRC.
 * FRAME_PARSE_BAD: a frame was dropped (bad CRC or oversize length); hunting resumes. */
frame_parse_result_t frame_parser_feed(frame_parser_t *p, uint8_t byte);

#endif
