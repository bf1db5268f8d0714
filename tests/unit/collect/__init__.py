"""unit/collect"""
