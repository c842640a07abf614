/* Stand-in for crazyflie-firmware's position_controller.h (see stabilizer_types.h here). */
void positionControllerResetAllPID(float xActual, float yActual, float zActual);
void positionControllerResetAllfilters(void);
