"""Sizing the fleet to its SLO: a profile of the engine on one device, a discrete-event
simulator of the scheduler and router rules the engine really uses, a search over
deployments, and the live planner that scales prefill and decode workers."""
