"""unit/ui"""
