/* Binary framing of the processor-in-the-loop link: see frame.h. */
#include "frame.h"

enum { HUNT_SYNC0, HUNT_SYNC1, TYPE, SEQ, LEN, PAYLOAD, CRC_LO, CRC_HI };

uint16_t frame_crc16(const uint8_t *data, size_t n)
{
  uint16_t crc = 0xFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= (uint16_t)((uint16_t)data[i] << 8);
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000u) ? (uint16_t)((crc << 1) ^ 0x1021u) : (uint16_t)(crc << 1);
    }
  }
  return crc;
}

size_t frame_encode(uint8_t type, uint8_t seq, const uint8_t *payload, uint8_t len, uint8_t out[FRAME_MAX_SIZE])
{
  if (len > FRAME_MAX_PAYLOAD) {
    return 0;
  }
  out[0] = FRAME_SYNC0;
  out[1] = FRAME_SYNC1;
  out[2] = type;
  out[3] = seq;
  out[4] = len;
  for (uint8_t i = 0; i < len; ++i) {
    out[FRAME_HEADER_SIZE + i] = payload[i];
  }
  const uint16_t crc = frame_crc16(&out[2], 3u + len);
  out[FRAME_HEADER_SIZE + len] = (uint8_t)(crc & 0xFFu);
  out[FRAME_HEADER_SIZE + len + 1u] = (uint8_t)(crc >> 8);
  return FRAME_HEADER_SIZE + len + 2u;
}

void frame_parser_init(frame_parser_t *p)
{
  p->state = HUNT_SYNC0;
  p->got = 0;
  p->crc_lo = 0;
}

static uint16_t received_crc(const frame_parser_t *p, uint8_t crc_hi)
{
  return (uint16_t)(p->crc_lo | (uint16_t)((uint16_t)crc_hi << 8));
}

static uint16_t expected_crc(const frame_t *f)
{
  uint8_t buf[3u + FRAME_MAX_PAYLOAD];
  buf[0] = f->type;
  buf[1] = f->seq;
  buf[2] = f->len;
  for (uint8_t i = 0; i < f->len; ++i) {
    buf[3 + i] = f->payload[i];
  }
  return frame_crc16(buf, 3u + f->len);
}

frame_parse_result_t frame_parser_feed(frame_parser_t *p, uint8_t byte)
{
  switch (p->state) {
  case HUNT_SYNC0:
    if (byte == FRAME_SYNC0) {
      p->state = HUNT_SYNC1;
    }
    return FRAME_PARSE_MORE;
  case HUNT_SYNC1:
    /* A repeated 0xA5 may itself be the start of the sync pair. */
    p->state = byte == FRAME_SYNC1 ? TYPE : (byte == FRAME_SYNC0 ? HUNT_SYNC1 : HUNT_SYNC0);
    return FRAME_PARSE_MORE;
  case TYPE:
    p->frame.type = byte;
    p->state = SEQ;
    return FRAME_PARSE_MORE;
  case SEQ:
    p->frame.seq = byte;
    p->state = LEN;
    return FRAME_PARSE_MORE;
  case LEN:
    if (byte > FRAME_MAX_PAYLOAD) {
      p->state = HUNT_SYNC0;
      return FRAME_PARSE_BAD;
    }
    p->frame.len = byte;
    p->got = 0;
    p->state = byte == 0 ? CRC_LO : PAYLOAD;
    return FRAME_PARSE_MORE;
  case PAYLOAD:
    p->frame.payload[p->got++] = byte;
    if (p->got == p->frame.len) {
      p->state = CRC_LO;
    }
    return FRAME_PARSE_MORE;
  case CRC_LO:
    p->crc_lo = byte;
    p->state = CRC_HI;
    return FRAME_PARSE_MORE;
  default: /* CRC_HI */
    p->state = HUNT_SYNC0;
    return received_crc(p, byte) == expected_crc(&p->frame) ? FRAME_PARSE_OK : FRAME_PARSE_BAD;
  }
}
