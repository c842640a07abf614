/* Stand-in for crazyflie-firmware's attitude_controller.h (see stabilizer_types.h here). */
void attitudeControllerResetAllPID(float rollActual, float pitchActual, float yawActual);
