/* The STM32F405 as QEMU's netduinoplus2 machine models it: USART1 (the first -serial), SysTick,
 * ARM semihosting. Polled I/O, no interrupt handlers. QEMU-only: clock tree, GPIO alternate functions and
 * baud rate, which the model ignores, are not set up. */
#ifndef BOARD_H
#define BOARD_H

#include <stdint.h>

void uart_init(void);
void uart_write(const uint8_t *data, uint32_t n);
uint8_t uart_read_byte(void); /* blocks until a byte arrives */

/* SysTick as a free-running 24-bit down-counter on the core clock (168 MHz in QEMU's model).
 * Under `qemu -icount shift=N` every instruction advances virtual time by 2^N ns, so the tick
 * count of an interval measures the instructions executed in it (see firmware/pil.py). */
void ticks_init(void);
uint32_t ticks_now(void);
uint32_t ticks_elapsed(uint32_t start, uint32_t end);

void semihost_print(const char *text); /* to QEMU's stderr */
void semihost_exit(int code);          /* ends QEMU with this exit status */

#endif
