/* Host driver for the generated policy (policies.export's check, the tests): runs policy_step on
 * every observation of a binary file.
 *
 * usage: policy_driver <obs.bin> <out.bin>
 *   obs.bin: float32 rows of POLICY_OBS_DIM (native byte order)
 *   out.bin: per row, int32 return code then POLICY_ACT_DIM float32 actions
 * Prints "self_test <result>" (policy_self_test(POLICY_SELF_TEST_TOL)) on stdout. Exit 0 unless I/O failed.
 */
#include <stdint.h>
#include <stdio.h>

#include "policy.h"

int main(int argc, char **argv)
{
  if (argc != 3) {
    fprintf(stderr, "usage: %s <obs.bin> <out.bin>\n", argv[0]);
    return 2;
  }
  FILE *in = fopen(argv[1], "rb");
  FILE *out = fopen(argv[2], "wb");
  if (!in || !out) {
    fprintf(stderr, "cannot open %s or %s\n", argv[1], argv[2]);
    return 2;
  }
  policy_reset();
  printf("self_test %d\n", policy_self_test(POLICY_SELF_TEST_TOL));

  float obs[POLICY_OBS_DIM];
  float action[POLICY_ACT_DIM];
  long rows = 0;
  while (fread(obs, sizeof obs, 1, in) == 1) {
    int32_t rc = policy_step(obs, action);
    if (fwrite(&rc, sizeof rc, 1, out) != 1 || fwrite(action, sizeof action, 1, out) != 1) {
      fprintf(stderr, "write failed\n");
      return 2;
    }
    ++rows;
  }
  fclose(in);
  if (fclose(out) != 0) {
    return 2;
  }
  printf("rows %ld\n", rows);
  return 0;
}
