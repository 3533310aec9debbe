"""Executors behind one interface: JaxExecutor (real model), SimExecutor (virtual clock)."""
