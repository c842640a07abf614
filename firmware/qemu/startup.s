/* Reset handler of the bare-metal PIL image (STM32F405, Cortex-M4F).
 *
 * Written in assembly so that nothing runs before the FPU is enabled: with -mfloat-abi=hard the
 * compiler may use FPU registers in any C function, and an FPU instruction with CP10/CP11 access
 * disabled raises a UsageFault (NOCP). */
  .syntax unified
  .cpu cortex-m4
  .fpu fpv4-sp-d16
  .thumb

  .section .text.Reset_Handler, "ax", %progbits
  .global Reset_Handler
  .type Reset_Handler, %function
Reset_Handler:
  /* CPACR (0xE000ED88): full access to CP10 and CP11 (bits 20..23). */
  ldr r0, =0xE000ED88
  ldr r1, [r0]
  orr r1, r1, #(0xF << 20)
  str r1, [r0]
  dsb
  isb

  /* Copy initialised data from flash (_sidata) to RAM (_sdata .. _edata), word by word. */
  ldr r0, =_sidata
  ldr r1, =_sdata
  ldr r2, =_edata
copy_data:
  cmp r1, r2
  bhs zero_bss
  ldr r3, [r0], #4
  str r3, [r1], #4
  b copy_data

  /* Zero .bss (_sbss .. _ebss). */
zero_bss:
  ldr r1, =_sbss
  ldr r2, =_ebss
  movs r3, #0
zero_loop:
  cmp r1, r2
  bhs call_main
  str r3, [r1], #4
  b zero_loop

call_main:
  bl main
  /* main does not return; if it ever does, stop here. */
hang:
  b hang
  .size Reset_Handler, . - Reset_Handler
