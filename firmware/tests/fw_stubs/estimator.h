/* Stand-in for crazyflie-firmware's estimator.h (see stabilizer_types.h here). */
#ifndef ESTIMATOR_H
#define ESTIMATOR_H
typedef enum {
  StateEstimatorTypeAutoSelect = 0,
  StateEstimatorTypeComplementary,
  StateEstimatorTypeKalman,
} StateEstimatorType;
StateEstimatorType stateEstimatorGetType(void);
#endif
