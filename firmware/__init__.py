"""Crazyflie firmware for exported policies: the out-of-tree controller (crazyflie/), its host
tests and cross-build (build.py), and processor-in-the-loop on an emulated STM32F405 (qemu/, pil.py)."""
