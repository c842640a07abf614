# $(POLICY_STAMP): the content of the export POLICY_DIR's policy.c and policy.h, rewritten only when it
# changes. Objects built from an export depend on it, so that a build from another export rebuilds
# them even when that export's files are older than the objects (make compares times only).
# Included by firmware/Makefile and firmware/qemu/Makefile, with BUILD and POLICY_DIR set.
POLICY_STAMP := $(BUILD)/policy.sha256
.PHONY: FORCE
$(POLICY_STAMP): FORCE
	@mkdir -p $(@D)
	@sha256sum $(POLICY_DIR)/policy.c $(POLICY_DIR)/policy.h > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
