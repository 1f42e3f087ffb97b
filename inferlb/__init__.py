"""inferlb"""
