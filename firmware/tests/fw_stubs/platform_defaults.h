/* Stand-in for crazyflie-firmware's platform_defaults.h, cf2 values (see stabilizer_types.h here). */
#define THRUST_MAX 0.1125f /* N per motor at full command */
#define THRUST_MIN 0.02f /* N per motor: below it the battery compensation stops the motor */
