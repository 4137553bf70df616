"""Environments: making them from a config (Gymnasium ids, module:Id, wrappers), their spaces,
vector stepping."""
