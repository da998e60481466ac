"""liverl: online RL from production feedback for MoE policies."""
