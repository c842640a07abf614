/* Stand-in for the Crazyflie's FreeRTOS.h / FreeRTOSConfig.h (see stabilizer_types.h here). */
#include <stdint.h>
typedef uint32_t TickType_t;
#define M2T(X) ((unsigned int)(X))
#define T2M(X) ((unsigned int)(X))
