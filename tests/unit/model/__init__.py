"""unit/model"""
