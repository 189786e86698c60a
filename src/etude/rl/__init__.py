"""RL for coding agents: rollouts, group-relative advantages, PPO-clip, text-feedback KL."""
