/* Stand-in for crazyflie-firmware's platform_defaults.h, cf2 values (see stabilizer_types.h here). */
#define THRUST_MAX 0.1125f /* N per motor at full command */
