"""unit/tune"""
