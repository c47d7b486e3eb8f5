"""Running a recorded trial again: counterfactual replay and resume, along the world sizes it trained on."""
