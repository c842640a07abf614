/* Stand-in for crazyflie-firmware's app.h (see stabilizer_types.h here). */
void appMain(void);
