/* Stand-in for crazyflie-firmware's controller_pid.h (see stabilizer_types.h here). */
#include "stabilizer_types.h"
void controllerPidInit(void);
bool controllerPidTest(void);
void controllerPid(control_t *control, const setpoint_t *setpoint, const sensorData_t *sensors,
                   const state_t *state, const stabilizerStep_t stabilizerStep);
