"""Hydra config groups for verl's trainers: ``hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]``
then ``engine=mcore_rl``."""
