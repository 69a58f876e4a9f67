"""Images a trajectory saw: decoded and checked where they arrive (`images`), fetched from the hosts the operator
allows (`image_fetch`), stored once by content hash in the data dir (`image_store`), and counted into the
placeholder tokens the checkpoint's processor gives them (`vision`). Imports only the policy (for those hosts);
config, tokens, generation, proxy and server import it."""
