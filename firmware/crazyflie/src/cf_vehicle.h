/* Generated from sim/crazyflie/params.py by `python -m firmware.build vehicle-header`: do not edit.
 * tests/test_firmware.py fails when it is out of date. */
#ifndef CF_VEHICLE_H
#define CF_VEHICLE_H

/* Rotor thrust per rpm^2 of the simulated Crazyflie the policy was trained on, N/rpm^2. */
#define CF_KF 3.160000000e-10f

/* Action that commands the nominal hover speed on every rotor (14475.8 rpm); the
 * previous-action observation starts here, as at every training reset. */
#define CF_HOVER_ACTION 3.340530046e-01f

#endif
