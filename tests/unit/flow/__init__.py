"""dlmon.flow: how watches are assembled and how a dashboard's end decides the training's."""
