/* Stand-in for crazyflie-firmware's supervisor.h (see stabilizer_types.h here). */
#include <stdbool.h>
bool supervisorIsFlying(void);
