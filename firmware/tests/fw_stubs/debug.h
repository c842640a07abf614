/* Stand-in for crazyflie-firmware's debug.h (see stabilizer_types.h here). */
int consolePrintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define DEBUG_PRINT(fmt, ...) consolePrintf(DEBUG_MODULE ": " fmt, ##__VA_ARGS__)
