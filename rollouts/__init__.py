"""Off-peak rollouts: environments, the sandbox, rollout workers."""
