"""unit/flow"""
