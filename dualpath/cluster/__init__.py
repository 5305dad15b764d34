"""The PD-disaggregated cluster: the scheduler process, its messages, and the launcher."""
