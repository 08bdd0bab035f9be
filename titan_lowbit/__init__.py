"""titan_lowbit"""
