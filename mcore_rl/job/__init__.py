"""The main job: an end-to-end GRPO / PPO run (schema, toy task, loop). Entry: launch/train.py."""
