"""unit/export"""
