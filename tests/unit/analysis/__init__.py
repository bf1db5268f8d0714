"""unit/analysis"""
