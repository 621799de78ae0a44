//! Model configuration and tensor naming for the MiniMax-M2 family.
