/* libFuzzer target: arbitrary bytes as one observation (NaN, inf, huge, denormal included).
 *
 * Property: policy_step returns POLICY_OK with every action finite and in [-1, 1], or
 * POLICY_ERR_INPUT exactly when an observation is non-finite, or an error code with every
 * action equal to POLICY_SAFE_ACTION. Anything else aborts (a libFuzzer crash).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"

static void fail(const char *what, int rc)
{
  fprintf(stderr, "policy property violated: %s (rc %d)\n", what, rc);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  float obs[POLICY_OBS_DIM] = {0.0f};
  /* Short inputs fill the leading floats, the rest stay 0; longer inputs are truncated. */
  memcpy(obs, data, size < sizeof obs ? size : sizeof obs);
  int any_nonfinite = 0;
  for (int i = 0; i < POLICY_OBS_DIM; ++i) {
    any_nonfinite |= !isfinite(obs[i]);
  }

  float action[POLICY_ACT_DIM];
  int rc = policy_step(obs, action);
  if (rc == POLICY_OK) {
    if (any_nonfinite) {
      fail("non-finite observation accepted", rc);
    }
    for (int i = 0; i < POLICY_ACT_DIM; ++i) {
      if (!isfinite(action[i]) || action[i] < -1.0f || action[i] > 1.0f) {
        fail("action not finite or outside [-1, 1]", rc);
      }
    }
  } else if (rc == POLICY_ERR_INPUT || rc == POLICY_ERR_OUTPUT) {
    if ((rc == POLICY_ERR_INPUT) != any_nonfinite) {
      fail("POLICY_ERR_INPUT must be returned exactly for non-finite observations", rc);
    }
    for (int i = 0; i < POLICY_ACT_DIM; ++i) {
      if (action[i] != POLICY_SAFE_ACTION) {
        fail("error without the safe action", rc);
      }
    }
  } else {
    fail("unknown return code", rc);
  }
  return 0;
}
