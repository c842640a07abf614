/* Stand-in for crazyflie-firmware's controller.h (see stabilizer_types.h here). */
#include "stabilizer_types.h"
void controllerOutOfTreeInit(void);
bool controllerOutOfTreeTest(void);
void controllerOutOfTree(control_t *control, const setpoint_t *setpoint, const sensorData_t *sensors,
                         const state_t *state, const stabilizerStep_t stabilizerStep);
