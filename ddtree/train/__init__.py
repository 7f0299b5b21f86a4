"""Training a DFlash drafter for a target: data generation (`data`) and the training loop (`drafter`)."""
