/* Stand-in for crazyflie-firmware's log.h (see stabilizer_types.h here): type-checks the variables. */
#include <stdint.h>
#define LOG_UINT8 1
#define LOG_INT32 6
#define LOG_FLOAT 7
#define LOG_GROUP_START(name)
#define LOG_GROUP_STOP(name)
#define LOG_ADD(type, name, address) \
  static const void *const log_var_##name __attribute__((used)) = (address);
