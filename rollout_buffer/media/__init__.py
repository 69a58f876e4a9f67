"""Images a trajectory saw: decoded and checked where they arrive (`images`), stored once by content hash in the
data dir (`image_store`), and counted into the placeholder tokens the checkpoint's processor gives them
(`vision`)."""
