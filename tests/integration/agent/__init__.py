"""The in-process agent in real trainings: loaders, epochs, frameworks, containers, hostile peers."""
