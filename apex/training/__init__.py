"""What a learner core trains with: optimizers with guarded steps, device staging and the
pipelined step, a data-parallel group's all-reduce."""
