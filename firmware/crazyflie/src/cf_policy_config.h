/* The policy controller's configuration on a Crazyflie: the exported policy (policy.h), the vehicle
 * it was trained on (cf_vehicle.h) and the dead-man time, for a firmware whose normalized motor force
 * 1 is thrust_max N per motor and which stops a motor commanded below thrust_min N
 * (controller_oot.c: THRUST_MIN with the battery compensation, else 0). Used by controller_oot.c (the firmware's THRUST_MAX) and by the
 * emulated board's image (firmware/qemu/main.c, the stock CF2 value). Include the export's policy.h
 * first: this header does not, so that a policy.h left in this directory by an out-of-tree build is
 * never the one another build picks up. */
#ifndef CF_POLICY_CONFIG_H
#define CF_POLICY_CONFIG_H

#include "cf_policy_glue.h"
#include "cf_vehicle.h"

#ifndef POLICY_H
#error "include the export's policy.h before cf_policy_config.h"
#endif
/* The observation and action this glue builds and applies: contract crazyflie-rpm-v1 (sim/crazyflie/
 * contract.py). A policy of another contract can have the same sizes and still mean other things. */
#ifndef POLICY_CONTRACT_CRAZYFLIE_RPM_V1
#error "policy.h is not of contract crazyflie-rpm-v1 (or predates contract macros): re-export it"
#endif
#ifndef POLICY_SELF_TEST_TOL
#error "policy.h predates POLICY_SELF_TEST_TOL (the boot self-test's tolerance): re-export it"
#endif

/* main_loop_hz: the rate cfp_update() is called at and its input's step counts (the firmware's
 * RATE_MAIN_LOOP); the policy runs every POLICY_PERIOD_MS of those steps' time. */
static inline cfp_config_t cfp_vehicle_config(float thrust_max, float thrust_min, uint32_t main_loop_hz)
{
  const cfp_config_t cfg = {
    .policy_step = policy_step,
    .policy_reset = policy_reset,
    .rpm_max = POLICY_RPM_MAX,
    .kf = CF_KF,
    .thrust_max = thrust_max,
    .thrust_min = thrust_min,
    .hover_action = CF_HOVER_ACTION,
    .deadman_ms = CFP_DEADMAN_MS,
    .steps_per_period = main_loop_hz * POLICY_PERIOD_MS / 1000u,
  };
  return cfg;
}

#endif
