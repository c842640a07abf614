/* QEMU netduinoplus2 board support: vector table, fault handler, USART1, SysTick, semihosting. */
#include "board.h"

#define REG32(addr) (*(volatile uint32_t *)(addr))

/* USART1 (RM0090 section 30.6): QEMU connects it to the first -serial chardev. */
#define USART1_SR REG32(0x40011000u)
#define USART1_DR REG32(0x40011004u)
#define USART1_CR1 REG32(0x4001100Cu)
#define USART_SR_RXNE (1u << 5)
#define USART_SR_TXE (1u << 7)
#define USART_CR1_UE (1u << 13)
#define USART_CR1_TE (1u << 3)
#define USART_CR1_RE (1u << 2)
#define USART_CR1_RXNEIE (1u << 5)

/* NVIC: USART1 is interrupt 37, bit 5 of the second set/clear-pending registers. */
#define NVIC_ISER1 REG32(0xE000E104u)
#define NVIC_ICPR1 REG32(0xE000E284u)
#define USART1_IRQ_BIT (1u << (37 - 32))

/* SysTick (ARMv7-M ARM B3.3). */
#define SYST_CSR REG32(0xE000E010u)
#define SYST_RVR REG32(0xE000E014u)
#define SYST_CVR REG32(0xE000E018u)
#define SYST_CSR_ENABLE (1u << 0)
#define SYST_CSR_CLKSOURCE_CPU (1u << 2)
#define SYST_MAX 0x00FFFFFFu

/* Semihosting operations (ARM "Semihosting for AArch32 and AArch64"). */
#define SYS_WRITE0 0x04
#define SYS_EXIT_EXTENDED 0x20
#define ADP_STOPPED_APPLICATION_EXIT 0x20026u

extern uint32_t _estack;
void Reset_Handler(void);
static void fault_handler(void);

typedef void (*vector_t)(void);

/* Cortex-M core vectors only: interrupts stay masked, USART1 only wakes the core from WFI. */
__attribute__((section(".isr_vector"), used)) static const vector_t vector_table[16] = {
  (vector_t)&_estack, /* initial stack pointer */
  Reset_Handler,
  fault_handler, /* NMI */
  fault_handler, /* HardFault */
  fault_handler, /* MemManage */
  fault_handler, /* BusFault */
  fault_handler, /* UsageFault */
  0, 0, 0, 0,
  fault_handler, /* SVCall */
  fault_handler, /* DebugMonitor */
  0,
  fault_handler, /* PendSV */
  fault_handler, /* SysTick: never enabled as an interrupt */
};

static int semihost_call(int op, const void *arg)
{
  register int r0 __asm__("r0") = op;
  register const void *r1 __asm__("r1") = arg;
  __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
  return r0;
}

void semihost_print(const char *text)
{
  semihost_call(SYS_WRITE0, text);
}

void semihost_exit(int code)
{
  const uint32_t block[2] = {ADP_STOPPED_APPLICATION_EXIT, (uint32_t)code};
  semihost_call(SYS_EXIT_EXTENDED, block);
  for (;;) {
  }
}

/* Any exception is a bug in the image: say so and stop QEMU with a distinctive status. */
static void fault_handler(void)
{
  semihost_print("pil: unexpected exception (fault)\n");
  semihost_exit(3);
}

void uart_init(void)
{
  /* Interrupts stay masked (PRIMASK): the USART1 interrupt only wakes the core from WFI, no
   * handler ever runs. Sleeping instead of spinning on the status register keeps QEMU's vCPU
   * thread off the host CPU while it waits for the next byte, which halves the PIL round trip
   * on a busy host. */
  __asm__ volatile("cpsid i" ::: "memory");
  USART1_CR1 = USART_CR1_UE | USART_CR1_TE | USART_CR1_RE | USART_CR1_RXNEIE;
  NVIC_ISER1 = USART1_IRQ_BIT;
}

void uart_write(const uint8_t *data, uint32_t n)
{
  for (uint32_t i = 0; i < n; ++i) {
    while (!(USART1_SR & USART_SR_TXE)) {
    }
    USART1_DR = data[i];
  }
}

uint8_t uart_read_byte(void)
{
  /* WFI returns when an interrupt is pending even with PRIMASK set (ARMv7-M B1.5.19). */
  while (!(USART1_SR & USART_SR_RXNE)) {
    __asm__ volatile("wfi" ::: "memory");
  }
  const uint8_t byte = (uint8_t)(USART1_DR & 0xFFu);
  /* Reading DR lowers the interrupt line, the NVIC keeps it pending: clear it, or the next WFI
   * would return at once. RXNE is checked before every WFI, so no byte is missed. */
  NVIC_ICPR1 = USART1_IRQ_BIT;
  return byte;
}

void ticks_init(void)
{
  SYST_RVR = SYST_MAX;
  SYST_CVR = 0; /* any write clears the counter */
  SYST_CSR = SYST_CSR_CLKSOURCE_CPU | SYST_CSR_ENABLE;
}

uint32_t ticks_now(void)
{
  return SYST_CVR;
}

uint32_t ticks_elapsed(uint32_t start, uint32_t end)
{
  /* Down-counter: valid for intervals shorter than one 2^24-tick wrap (0.1 s at 168 MHz). */
  return (start - end) & SYST_MAX;
}
