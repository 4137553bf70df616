"""Ape-X DDPG (Horgan et al. 2018's Ape-X DPG with TD3's fixes, Fujimoto et al. 2018): the
noise ladder (``exploration``), the actor core (``actor``), the loss (``loss``) and the
learner core (``learner``)."""
