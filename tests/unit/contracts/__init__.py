"""unit/contracts"""
