/* Stand-in for FreeRTOS task.h (see stabilizer_types.h here). */
#include "FreeRTOS.h"
TickType_t xTaskGetTickCount(void);
void vTaskDelay(const TickType_t ticks);
